"""The loss of logits split by vocabulary across a TP group (the LM head ``parallelize_stage`` splits).

Apart from ``parallelize`` so that the profiler, which times one rank's share without
collectives, imports it without the training internals.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


def vocab_shard(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """(first token id, count) of the LM head's rows on ``tp_rank``: DTensor's ``Shard(0)`` split,
    which is ``torch.chunk``'s (ceil(V / tp) rows per rank, the last ranks fewer or none)."""
    per_rank = -(-vocab_size // tp)
    start = min(tp_rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from logits split by vocabulary across a TP group (Megatron's).

    Forward all-reduces each token's max logit, then its target logit and sum of exponentials
    (one collective for both): ``vocab_size / tp`` logits per rank are never gathered. Backward
    needs no communication: softmax minus the target's one-hot, on each rank's own columns.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        has_columns = logits.shape[-1] > 0  # not so on a rank past the end of a small vocabulary
        token_max = logits.max(dim=-1).values if has_columns else logits.new_full(logits.shape[:-1], float("-inf"))
        if group is not None:
            dist.all_reduce(token_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - token_max.unsqueeze(-1)  # a new fp32 tensor: the one this function keeps
        local = targets - vocab_start
        mine = (local >= 0) & (local < logits.shape[-1])
        local = torch.where(mine, local, 0)
        target_logit = (shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine if has_columns
                        else torch.zeros_like(token_max))
        exp = shifted.exp_()
        stats = torch.stack((target_logit, exp.sum(dim=-1)))
        if group is not None:
            dist.all_reduce(stats, group=group)
        softmax = exp.div_(stats[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine)
        return stats[1].log() - stats[0]

    @staticmethod
    @once_differentiable  # backward reuses the saved softmax in place: once only
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, mine = ctx.saved_tensors
        grad = softmax  # in place, as Megatron: the softmax is not needed after this
        if grad.shape[-1]:
            grad.scatter_add_(-1, local.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_lm_loss(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                           group: dist.ProcessGroup | None, scale: float = 1.0) -> torch.Tensor:
    """``lm_loss`` of logits this rank holds for token ids ``[vocab_start, vocab_start + logits.shape[-1])``.

    Every rank of ``group`` gets the same loss, equal to ``lm_loss`` of the gathered logits.
    ``group=None``: no collectives, one rank's share of the work (the profiler times it so).
    """
    flat = logits.reshape(targets.numel(), logits.shape[-1])  # -1 would be ambiguous on a rank with no columns
    per_token = _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), vocab_start, group)
    return per_token.mean() * scale
