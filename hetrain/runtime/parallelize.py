"""Parallelism applied to a plain stage from outside: tensor parallelism, and the gradient sync of
pipelines that cut the model in different places.

Each pipeline holds the whole model, cut at different places, so each gradient *bucket* (the
layers held by the same set of stages, ``hetrain.plan.layout``) is all-reduced among exactly
the ranks (one per pipeline, same TP rank) that hold those layers. The loss of every
micro-batch is scaled by ``micro_batch_size / global_batch_size`` and pipelines never
rescale, so after the SUM all-reduce each gradient is the gradient of the mean loss over
the whole global batch, as on one device, however the batch was split.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hetrain.plan.layout import SyncBucket
from hetrain.runtime.loss import vocab_shard
from hetrain.runtime.model import GPT
from hetrain.spec.arithmetic import GRAD_SYNC_CHUNK_NUMEL, sync_chunks

TP_PLAN = {
    "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(),
}
# SwiGLU's up projection is split like its gate: each rank multiplies its own slices
LLAMA_TP_PLAN = {**TP_PLAN, "mlp.w3": ColwiseParallel()}


def parallelize_stage(stage: GPT, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP per block: column-wise into attention heads and the MLP, row-wise out.

    Under grouped-query attention the key/value projections split by their own heads
    (``num_kv_heads / tp`` per rank), which keeps each query head with its key/value head.
    The LM head splits column-wise too, by vocabulary: each rank computes ``vocab_size / tp``
    logits and ``vocab_parallel_lm_loss`` takes the loss from the shards without gathering
    them (the head is the widest matrix product of a GPT: 0.8 of a block at 13B). The token
    embedding splits row-wise by vocabulary; GPT's learned positions (``seq_length`` rows) stay
    whole on every rank.
    """
    plan = LLAMA_TP_PLAN if stage.spec.arch == "llama" else TP_PLAN
    if stage.tok_embedding is not None:
        stage.tok_embedding = VocabParallelEmbedding(stage.tok_embedding, tp_mesh)
    for block in stage.layers.values():
        parallelize_module(block, tp_mesh, plan)
        for norm in (getattr(block.attn, "q_norm", None), getattr(block.attn, "k_norm", None)):
            if norm is not None:  # Qwen 3's head norms: each rank's heads give part of the gradient
                norm.tp_group = tp_mesh.get_group()
    if stage.head is not None:
        # local logits out: hetrain.runtime.loss takes the loss from the shards
        parallelize_module(stage.head, tp_mesh, ColwiseParallel())
        if stage.spec.tied and stage.tok_embedding is not None:  # one stage holds both ends: one weight again,
            stage.head.weight = stage.tok_embedding.weight  # the embedding's rows, split alike (Shard(0))


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the TP group; backward: the gradient as it is (the same on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        if x.device.type != "meta":
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class VocabParallelEmbedding(nn.Module):
    """A token embedding split by vocabulary across a TP group (Megatron's VocabParallelEmbedding).

    Each rank keeps ``vocab_size / tp`` rows (``Shard(0)``, so checkpoints reshard it like the
    other TP weights), looks up the tokens in its range, zeros for the rest, and the group sums
    the fp32 outputs: one all-reduce forward, none backward (the output's gradient is the same
    on every rank). Its weights, optimizer state and gradient sync shrink tp-fold.
    (Written out rather than DTensor's ``RowwiseParallel`` on the embedding: that keeps the
    lookup's mask in its output placement (``MaskPartial``), which a later micro-batch's forward
    replaces before 1F1B runs an earlier one's backward: the embedding's gradient came out 4.6 %
    off on the gpt-tiny TP 2 equivalence test.)
    """

    def __init__(self, embedding: nn.Embedding, tp_mesh: DeviceMesh):
        super().__init__()
        self.weight = nn.Parameter(distribute_tensor(embedding.weight.detach(), tp_mesh, [Shard(0)]))
        self.group = tp_mesh.get_group()
        self.vocab_start, _ = vocab_shard(embedding.num_embeddings, self.group.size(), self.group.rank())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = self.weight.to_local()
        shifted = ids - self.vocab_start
        outside = (shifted < 0) | (shifted >= local.shape[0])
        if local.shape[0]:
            out = F.embedding(shifted.masked_fill(outside, 0), local).masked_fill(outside.unsqueeze(-1), 0.0)
        else:  # a rank past the end of a small vocabulary: zeros, still in the graph (its gradient is
            # empty), in the weights' dtype like the other ranks' lookups, whatever autocast makes of the product
            out = (local.new_zeros(*ids.shape, 0) @ local).to(local.dtype)
        return _SumOverGroup.apply(out, self.group)


# torch 2.13 renamed all_gather_into_tensor (same arguments); earlier releases have only the old name
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_flat(chunk: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The TP group's flat chunks, concatenated in rank order."""
    out = chunk.new_empty(chunk.numel() * group.size())
    if chunk.device.type != "meta":  # shape inference on meta tensors (older torch) sends nothing
        _all_gather_flat(out, chunk.contiguous().view(-1), group=group)
    return out


def _own_chunk(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's 1/tp of ``x``, flat, as ``(*x.shape[:-1], x.shape[-1] // tp)`` (a copy: ``x`` may be freed)."""
    t, r = group.size(), group.rank()
    n = x.numel() // t
    return x.reshape(-1)[r * n:(r + 1) * n].clone().view(*x.shape[:-1], x.shape[-1] // t)


class _SendOwnChunk(torch.autograd.Function):
    """Forward: this TP rank's chunk of the stage output, the part it sends; backward: the
    gradient chunks the ranks received, gathered (the gradient is the same on every TP rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.shape = group, x.shape
        return _own_chunk(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_flat(grad, ctx.group).view(ctx.shape), None


class _GatherReceived(torch.autograd.Function):
    """Forward: the chunks the TP ranks received, gathered into the stage input; backward: this
    rank's chunk of its gradient, the part it sends back."""

    @staticmethod
    def forward(ctx, chunk: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_flat(chunk, group).view(*chunk.shape[:-1], chunk.shape[-1] * group.size())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_chunk(grad, ctx.group), None


def scatter_gather_sends(stage: GPT, tp_group: dist.ProcessGroup, *, is_first: bool, is_last: bool) -> None:
    """Megatron's scatter-gather between pipeline stages under TP: each TP rank sends 1/tp of the
    activation (and of its gradient) instead of all of it, and the receiving TP group all-gathers
    it over its node's fast links. A stage boundary between nodes carries 1/tp of the bytes.

    Apply after ``apply_mixed_precision``: the chunk is cut from the stage output in the compute
    dtype, and the received chunks are gathered before the stage casts its input to fp32.
    """
    if not is_last:
        stage.register_forward_hook(lambda _m, _args, out: _SendOwnChunk.apply(out, tp_group))
    if not is_first:
        stage.register_forward_pre_hook(
            lambda _m, args: (_GatherReceived.apply(args[0], tp_group), *args[1:]), prepend=True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def tied_weight(stage: GPT) -> nn.Parameter | None:
    """A tied model's one weight on this stage: the embedding's (first stage), else the head's (last stage)."""
    if not stage.spec.tied:
        return None
    if stage.tok_embedding is not None:
        return stage.tok_embedding.weight
    return stage.head.weight if stage.head is not None else None


def norm_counted(stage: GPT, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """``params`` less a last stage's copy of the tied weight: the first stage's copy (the same gradient once
    synced) counts it in the global gradient norm, once."""
    if not stage.spec.tied or stage.tok_embedding is not None or stage.head is None:
        return params
    return [p for p in params if p is not stage.head.weight]


def bucket_params(stage: GPT, bucket: SyncBucket) -> list[nn.Parameter]:
    """This stage's parameters in ``bucket``; a tied weight only in the tied bucket (``SyncBucket.tied``)."""
    names = []
    if bucket.embedding and stage.tok_embedding is not None:
        names += ["tok_embedding"] + (["pos_embedding"] if stage.pos_embedding is not None else [])
    lo, hi = bucket.layers
    names += [f"layers.{i}" for i in range(lo, hi) if str(i) in stage.layers]
    if bucket.head and stage.head is not None:
        names += ["norm", "head"]
    params = [p for n in names for p in stage.get_submodule(n).parameters()]
    tied = tied_weight(stage)
    params = [p for p in params if p is not tied] + ([tied] if bucket.tied and tied is not None else [])
    return list({id(p): p for p in params}.values())  # a tied head and embedding on one stage: one weight, once


@torch.no_grad()
def sync_gradients(buckets: list[tuple[dist.ProcessGroup, list[nn.Parameter]]], reduce_dtype: torch.dtype,
                   grads_of: list[torch.Tensor] | None = None, chunk_numel: int = GRAD_SYNC_CHUNK_NUMEL) -> None:
    """All-reduce each bucket's gradients among the ranks holding those layers, in chunks of at most
    ``GRAD_SYNC_CHUNK_NUMEL`` elements (``sync_chunks``: the flat copy is one chunk, not the bucket;
    ``hetrain.cost.stage`` prices it).

    ``grads_of``: the (one) bucket's gradient tensors to reduce in place instead of its parameters' ``.grad``.
    """
    for group, params in buckets:
        grads = grads_of
        if grads is None:
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local_tensor(p.grad))
        pieces = _sync_pieces(grads, chunk_numel)
        for lo, hi in sync_chunks([g.numel() for g in pieces], chunk_numel):
            _all_reduce_chunk(pieces[lo:hi], reduce_dtype, group)


def _sync_pieces(grads: list[torch.Tensor], limit: int) -> list[torch.Tensor]:
    """The gradients as flat views of at most ``limit`` elements each (a contiguous tensor longer than that
    in slices, reduced in place), so no chunk's copy is longer than the limit."""
    out = []
    for g in grads:
        if not g.is_contiguous() or g.numel() <= limit:
            out.append(g)
            continue
        flat = g.view(-1)
        out += [flat[at:at + limit] for at in range(0, flat.numel(), limit)]
    return out


def _all_reduce_chunk(grads: list[torch.Tensor], reduce_dtype: torch.dtype, group: dist.ProcessGroup) -> None:
    """One collective over ``grads``: a lone contiguous gradient already in the wire dtype in place, else flat."""
    if len(grads) == 1 and grads[0].dtype == reduce_dtype and grads[0].is_contiguous():
        dist.all_reduce(grads[0], group=group)
        return
    flat = _flatten_dense_tensors(grads)
    wire = flat.to(reduce_dtype)  # fp32 grads: a no-op unless the plan reduces in bf16
    dist.all_reduce(wire, group=group)
    if wire is not flat:
        flat.copy_(wire)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
