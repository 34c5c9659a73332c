"""A plain decoder-only transformer built from a ``ModelSpec``; parallelism is applied elsewhere.

Two block architectures: GPT-2 style (``arch: gpt``: LayerNorm, GELU MLP, learned positions,
multi-head attention) and Llama style (``arch: llama``: RMSNorm, SwiGLU MLP, rotary positions
computed in each block from the sequence positions, grouped-query attention). Projections
read their head counts from their widths, so a tensor-parallel shard (``-1`` heads) runs the
same code.

Blocks live in a ``ModuleDict`` keyed by their global index, so a pipeline stage is the
same class holding a contiguous range of blocks and parameter names (``layers.7.attn.wq.weight``)
are identical whichever plan built the stage: checkpoints and gradient buckets line up
across plans. The embedding lives on the first stage, the final norm and LM head on the last.
A tied model (``tie_embeddings``) has one weight for both: one Parameter where one stage holds
both ends, else a copy on each end, drawn alike, whose gradients ``hetrain.runtime.tied`` sums.

Initialisation is a pure function of (seed, parameter name): every stage, on every plan,
starts from exactly the weights a single-process model would have.
"""

from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hetrain.spec.specs import RECOMPUTE_MODES, ModelSpec, RecomputeMode, RopeScaling

INIT_STD = 0.02
# A tied model's one weight: the embedding's name on the first stage, the head's on the last (named_parameters
# gives the first where one stage holds both)
TIED_NAME, HEAD_NAME = "tok_embedding.weight", "head.weight"


def _ops(*names: str) -> frozenset:
    """The ops of this torch build among ``names`` (``ns.op.overload``): newer builds add attention kernels."""
    found = set()
    for name in names:
        ns, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


# Selective recompute keeps what is costly to compute (matrix products, attention, tensor-parallel
# all-reduces) and recomputes the rest in backward: norms, GELU, residual adds and autocast's 16-bit
# weight copies, which hold much of a block's memory and cost a few percent of its time. It is the
# SDPA-era counterpart of Megatron's "selective" (which drops the s x s attention scores): SDPA keeps
# no s x s matrix, so recomputing the attention core alone would save nothing here.
SELECTIVE_SAVE = _ops(
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default",
    "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_gather_into_tensor.default",
)


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def run_block(block: nn.Module, x: torch.Tensor, recompute: RecomputeMode) -> torch.Tensor:
    """One block's forward under a recompute mode (see ``SELECTIVE_SAVE``); plain outside autograd."""
    if recompute == "none" or not torch.is_grad_enabled():
        return block(x)
    if recompute == "full":
        return checkpoint(block, x, use_reentrant=False)
    return checkpoint(block, x, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _selective_policy))


@torch.no_grad()
def init_parameter(name: str, param: torch.Tensor, gen: torch.Generator) -> None:
    """Norm weights 1, biases 0 (norms' and Qwen's q/k/v: transformers starts them at 0 too), everything
    else N(0, INIT_STD) drawn from ``gen``."""
    if name.endswith("norm.weight"):
        param.fill_(1.0)
    elif name.endswith(".bias"):
        param.zero_()
    else:
        param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)

class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.wq = nn.Linear(hidden_size, hidden_size, bias=False)
        self.wk = nn.Linear(hidden_size, hidden_size, bias=False)
        self.wv = nn.Linear(hidden_size, hidden_size, bias=False)
        self.wo = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_size, bias=False)
        self.w2 = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(spec.hidden_size)
        self.attn = Attention(spec.hidden_size, spec.num_heads)
        self.mlp_norm = nn.LayerNorm(spec.hidden_size)
        self.mlp = MLP(spec.hidden_size, spec.ffn_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` of the head dimension's two halves: the rotary convention of Hugging Face's Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> torch.Tensor:
    """The rotation speed of each pair of the head dimension, ``(head_dim / 2,)``, fp32; Llama 3.1's scaling
    (``RopeScaling``) as transformers computes it (``_compute_llama3_parameters``): long wavelengths slowed
    ``factor`` times, short ones kept, a smooth blend between."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    original = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = original / scaling.low_freq_factor, original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, ``(seq_len, head_dim)``, in fp32.

    Computed where they are used rather than stored: a few thousand multiply-adds per block,
    nothing to checkpoint or shard, and the same values on every stage of every plan.
    """
    inv_freq = inverse_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class _GradSummedOver(torch.autograd.Function):
    """Forward: the weight as it is; backward: its gradient summed over a TP group.

    For a replicated weight that each TP rank applies to its own heads (Qwen 3's q/k norms): each
    rank's gradient is its heads' part, and the ranks must step with the whole one.
    """

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        if grad.device.type != "meta":
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class HeadNorm(nn.RMSNorm):
    """RMSNorm over each attention head's ``head_dim`` values (Qwen 3's ``q_norm``/``k_norm``), one weight
    shared by every head. ``tp_group`` (set by ``hetrain.runtime.parallelize``): the ranks whose heads share it."""

    tp_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.tp_group is None else _GradSummedOver.apply(self.weight, self.tp_group)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary positions: ``num_kv_heads`` key/value heads, each shared
    by ``num_heads / num_kv_heads`` query heads (under TP each rank holds a slice of both).

    The families' switches (``ModelSpec``): a bias on q, k and v (``qkv_bias``, Qwen 2), an RMSNorm
    over each q and k head before the rotation (``qk_norm``, Qwen 3), heads of ``head_size`` whatever
    the hidden size, and Llama 3.1's rotary scaling (``rope_scaling``).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = spec.head_dim, spec.rope_base, spec.rope_scaling
        h, bias = spec.hidden_size, bool(spec.qkv_bias)
        self.wq = nn.Linear(h, spec.q_size, bias=bias)
        self.wk = nn.Linear(h, spec.kv_size, bias=bias)
        self.wv = nn.Linear(h, spec.kv_size, bias=bias)
        self.wo = nn.Linear(spec.q_size, h, bias=False)
        self.q_norm = HeadNorm(spec.head_dim, eps=spec.eps) if spec.qk_norm else None
        self.k_norm = HeadNorm(spec.head_dim, eps=spec.eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        cos, sin = (c.to(q.dtype) for c in rope_tables(t, self.head_dim, self.theta, x.device, self.scaling))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = q.shape[1] // k.shape[1]
        if group > 1:  # each key/value head serves `group` query heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: Llama's MLP (w1 the gate, w3 the up projection, w2 down)."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_size, bias=False)
        self.w2 = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(spec.hidden_size, eps=spec.eps)
        self.attn = LlamaAttention(spec)
        self.mlp_norm = nn.RMSNorm(spec.hidden_size, eps=spec.eps)
        self.mlp = SwiGLU(spec.hidden_size, spec.ffn_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def make_block(spec: ModelSpec) -> nn.Module:
    """One transformer block of ``spec``'s architecture."""
    return LlamaBlock(spec) if spec.arch == "llama" else Block(spec)


def final_norm(spec: ModelSpec) -> nn.Module:
    return nn.RMSNorm(spec.hidden_size, eps=spec.eps) if spec.arch == "llama" else nn.LayerNorm(spec.hidden_size)


class GPT(nn.Module):
    """The whole model, or one pipeline stage of it (blocks ``[first_layer, end_layer)``), of either architecture.

    ``chunks`` instead of ``layers``: the block ranges of an interleaved-1F1B rank (several chunks of
    the model, in order), held in one module so that parameter names, initialisation, gradient
    buckets, the optimizer and checkpoints see one stage as ever; ``chunk`` gives each range's view
    to pipeline.
    """

    def __init__(
        self,
        spec: ModelSpec,
        layers: tuple[int, int] | None = None,
        *,
        has_embedding: bool | None = None,
        has_head: bool | None = None,
        recompute: RecomputeMode | bool = "none",
        chunks: list[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        chunks = list(chunks) if chunks else [layers if layers is not None else (0, spec.num_layers)]
        for lo, hi in chunks:
            if not 0 <= lo < hi <= spec.num_layers:
                raise ValueError(f"layers [{lo}, {hi}) outside the {spec.num_layers} blocks of {spec.name}")
        lo, hi = chunks[0][0], chunks[-1][1]
        self.spec = spec
        self.layer_range = (lo, hi)
        if isinstance(recompute, bool):
            recompute = "full" if recompute else "none"
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute: expected one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
        self.recompute: RecomputeMode = recompute
        first = lo == 0 if has_embedding is None else has_embedding
        last = hi == spec.num_layers if has_head is None else has_head
        self.tok_embedding = nn.Embedding(spec.vocab_size, spec.hidden_size) if first else None
        # learned positions (GPT); Llama's are rotary, inside its attention
        self.pos_embedding = nn.Embedding(spec.seq_length, spec.hidden_size) if first and spec.arch == "gpt" else None
        self.layers = nn.ModuleDict({str(i): make_block(spec) for a, b in chunks for i in range(a, b)})
        self.norm = final_norm(spec) if last else None
        self.head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if last else None
        if spec.tied and first and last:  # one tensor; on different stages hetrain.runtime.tied sums their gradients
            self.head.weight = self.tok_embedding.weight

    def chunk(self, lo: int, hi: int) -> GPT:
        """A view of blocks ``[lo, hi)`` of this module (its embedding where lo is 0, its head where hi is
        the model's end): the same submodules, so the same parameters, run as one pipeline stage."""
        view = GPT.__new__(GPT)
        nn.Module.__init__(view)
        view.spec, view.layer_range, view.recompute = self.spec, (lo, hi), self.recompute
        first, last = lo == 0, hi == self.spec.num_layers
        view.tok_embedding = self.tok_embedding if first else None
        view.pos_embedding = self.pos_embedding if first else None
        view.layers = nn.ModuleDict({str(i): self.layers[str(i)] for i in range(lo, hi)})
        view.norm, view.head = (self.norm, self.head) if last else (None, None)
        return view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits out."""
        if self.tok_embedding is not None:
            ids = x
            x = self.tok_embedding(ids)
            if self.pos_embedding is not None:
                x = x + self.pos_embedding(torch.arange(ids.shape[1], device=ids.device))
        for block in self.layers.values():
            x = run_block(block, x, self.recompute)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic per parameter name, so any stage of any plan matches the full model."""
        for name, param in self.named_parameters():
            drawn_as = TIED_NAME if self.spec.tied and name == HEAD_NAME else name  # a tied head: the embedding's values
            init_parameter(name, param, torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(drawn_as.encode())))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Mean next-token cross entropy over the tokens of ``logits``, times ``scale``.

    The runtime passes ``scale = micro_batch_size / global_batch_size`` so that summing the
    micro-batch losses of every pipeline gives the mean over the global batch.
    """
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    return loss * scale
