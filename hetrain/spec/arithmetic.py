r"""Model arithmetic: parameter counts, FLOPs and activation bytes of the model as ``hetrain.runtime`` runs it.

Depends only on the model spec and the training settings, never on the cluster: the cost model
(``hetrain.cost``), the profiler and the benchmarks share it. Torch-free. Symbols: ``h`` hidden
size, ``f`` FFN size, ``a`` heads, ``s`` sequence length, ``V`` vocabulary, ``b`` micro-batch
size, ``t`` TP degree, ``B_act`` bytes per activation element (2 for bf16/fp16, 4 for fp32).

Parameters
    block  P_blk  = 4h^2 + 2hf + 9h + f        (QKV+proj with biases, MLP with biases, 2 LayerNorms)
    embed  P_emb  = V h + s h                  (token + learned position embedding, first stage)
    head   P_head = V h + 2h                   (final LayerNorm + LM head, last stage)
    Llama-arch blocks: 2 h q + 2 h kv + 3 h f + 2h (q = heads x head size, kv = kv heads x head size),
    + q + 2 kv with Qwen 2's q/k/v bias, + 2 x head size with Qwen 3's q/k norms. A tied LM head is
    the embedding's weight: once in ``total_params``, a copy on each end where they are different stages.
    Blocks, the head and the token embedding are split over the t ranks of a TP group (the
    head and the embedding by vocabulary); GPT's learned positions are whole on every rank.

FLOPs per micro-batch (Megatron's FLOP count; backward = 2 x forward)
    block forward FLOPs  = b (2 s (4h^2 + 2hf) + 4 s^2 h)
    head  forward FLOPs  = 2 b s h V

Activations per block per micro-batch (``block_activation_bytes``), counted as the runtime holds
    them (bf16/fp16 run under autocast over fp32 parameters, see hetrain.runtime.precision): the
    fp32 LayerNorm inputs and the projection inputs whole, q/k/v, attention output and MLP hidden
    split by t, SDPA (no s x s scores), autocast's 16-bit weight copies; with full recompute only
    the block input s b h * 4 (the residual stream is fp32) is kept; selective recompute keeps
    what is costly to redo (``selective_activation_bytes``).
"""

from __future__ import annotations

from hetrain.spec.specs import ModelSpec, TrainingSettings


def block_params(model: ModelSpec) -> int:
    h, f = model.hidden_size, model.ffn_size
    if model.arch == "llama":  # q and o h x (heads x head size), k and v h x kv (grouped-query), SwiGLU's three,
        # two RMSNorms, and the families' switches: Qwen 2's q/k/v biases, Qwen 3's per-head q and k norms
        biases = model.q_size + 2 * model.kv_size if model.qkv_bias else 0
        head_norms = 2 * model.head_dim if model.qk_norm else 0
        return 2 * h * model.q_size + 2 * h * model.kv_size + 3 * h * f + 2 * h + biases + head_norms
    return 4 * h * h + 2 * h * f + 9 * h + f


def embed_params(model: ModelSpec, tp: int = 1) -> int:
    """The embedding's parameters on one TP rank: its share of the token rows (DTensor's split,
    the first ranks ceil(V / tp)), and GPT's learned positions whole (Llama's are rotary)."""
    positions = model.seq_length * model.hidden_size if model.arch == "gpt" else 0
    return -(-model.vocab_size // tp) * model.hidden_size + positions


def head_params(model: ModelSpec) -> int:
    return model.vocab_size * model.hidden_size + head_norm_params(model)


def block_norm_params(model: ModelSpec) -> int:
    """The block's norm parameters (GPT: two LayerNorms' weights and biases; Llama: two RMSNorm weights, Qwen 3's
    q/k head norms): the only ones of a block no matrix multiply reads, so the only ones autocast does not round
    to 16 bits."""
    if model.arch == "gpt":
        return 4 * model.hidden_size
    return 2 * model.hidden_size + (2 * model.head_dim if model.qk_norm else 0)


def head_norm_params(model: ModelSpec) -> int:
    """The final norm's parameters (LayerNorm's weight and bias / RMSNorm's weight), beside the LM head."""
    return 2 * model.hidden_size if model.arch == "gpt" else model.hidden_size


def tied_params(model: ModelSpec) -> int:
    """The parameters the LM head shares with the token embedding (``tie_embeddings``): counted once where one
    stage holds both ends; where they sit on different stages, each keeps a copy."""
    return model.vocab_size * model.hidden_size if model.tied else 0


def total_params(model: ModelSpec) -> int:
    """The model's distinct parameters (a tied weight once), as transformers counts them."""
    return model.num_layers * block_params(model) + embed_params(model) + head_params(model) - tied_params(model)


def block_forward_flops(model: ModelSpec, micro_batch_size: int) -> float:
    h, f, s = model.hidden_size, model.ffn_size, model.seq_length
    if model.arch == "llama":  # attention's core is q_size wide (heads x head size: Qwen 3's differ from h)
        matmuls, core = 2 * h * model.q_size + 2 * h * model.kv_size + 3 * h * f, model.q_size
    else:
        matmuls, core = 4 * h * h + 2 * h * f, h
    return micro_batch_size * (2 * s * matmuls + 4 * s * s * core)


def block_weight_grad_fraction(model: ModelSpec) -> float:
    """The share of a block's backward that is weight gradients (ZB-H1's W, ``hetrain.cost.pipeline``).

    Backward is two forwards of FLOPs: each weight matrix's product gives one for the input
    gradient and one for the weight gradient; attention's core (no weights) is all input gradient.
    """
    s = model.seq_length
    core = model.q_size if model.arch == "llama" else model.hidden_size
    matmuls = block_forward_flops(model, 1) - 4 * s * s * core
    return matmuls / (2 * block_forward_flops(model, 1))


def block_weight_grad_bytes(model: ModelSpec, settings: TrainingSettings, tp: int, micro_batch_size: int) -> float:
    """Bytes one block holds per micro-batch between its input gradient (B) and its weight gradient (W).

    torch.distributed.pipelining's split backward keeps the gradient arriving at each node that
    leads to a weight (``stage_backward_input``'s hooks): the output gradient of every projection
    (column-parallel ones split ``tp`` ways, row-parallel ones whole) in the compute dtype, and of
    the two norms (fp32). The activations themselves stay too (the graph is retained): counted with
    the activations.
    """
    h, f, s, b, t = model.hidden_size, model.ffn_size, model.seq_length, micro_batch_size, tp
    if model.arch == "llama":  # q, k, v, SwiGLU's gate and up (column); o and down (row)
        column, row = model.q_size + 2 * model.kv_size + 2 * f, 2 * h
    else:  # q, k, v, fc1 (column); o and fc2 (row)
        column, row = 3 * h + f, 2 * h
    return s * b * (settings.activation_bytes * (column / t + row) + 2 * h * RESIDUAL_BYTES)


def head_forward_flops(model: ModelSpec, micro_batch_size: int) -> float:
    return 2.0 * micro_batch_size * model.seq_length * model.hidden_size * model.vocab_size


def train_flops_per_sequence(model: ModelSpec, activation_recompute: bool) -> float:
    """FLOPs of forward + backward (+ full recompute's extra forward) for one sequence through the whole model."""
    mult = 4 if activation_recompute else 3
    return mult * model.num_layers * block_forward_flops(model, 1) + 3 * head_forward_flops(model, 1)


RESIDUAL_BYTES = 4  # the residual stream stays fp32 under autocast (hetrain.runtime.precision)
# The gradient sync moves a bucket in collectives of at most this many elements (its parameters
# packed in order; one larger than this alone), so the flat copy it reduces, and a sharded
# bucket's all-gather buffer, is one chunk, not the whole bucket: a whole bucket's fp32 copy is
# 4 bytes per parameter on top of the 16 a stage keeps, half of what sharding the moments between
# two replicas saves. 16 M elements (64 MB in fp32) are messages long enough for a ring to run
# at its bandwidth (NCCL's reach it from a few MB) and a fraction of a percent of a GPU's memory.
GRAD_SYNC_CHUNK_NUMEL = 16 * 2**20


def sync_chunks(numels: list[int], limit: int) -> list[tuple[int, int]]:
    """Index ranges ``[lo, hi)`` of consecutive tensors of ``numels`` elements, each range at most ``limit``
    elements (a tensor larger than ``limit`` alone): the collectives a bucket's sync runs."""
    out: list[tuple[int, int]] = []
    lo, total = 0, 0
    for i, n in enumerate(numels):
        if i > lo and total + n > limit:
            out.append((lo, i))
            lo, total = i, 0
        total += n
    if lo < len(numels):
        out.append((lo, len(numels)))
    return out


def block_activation_bytes(model: ModelSpec, settings: TrainingSettings, tp: int, micro_batch_size: int) -> float:
    """Bytes one block saves for backward for one micro-batch, as ``hetrain.runtime`` runs it.

    Counted tensor by tensor (and checked against ``AllocationTracker`` in the tests): the two
    LayerNorm inputs (the fp32 residual stream) and the two projection inputs are whole on
    every TP rank; q, k, v, the attention output and the MLP's hidden activation before and
    after GELU are split ``tp`` ways. Attention is SDPA (flash or memory-efficient): no
    ``s x s`` score matrix is kept, unlike Korthikanti et al.'s count for unfused attention.
    Under autocast, the 16-bit copies of the block's weights are saved for backward too.
    """
    h, f, s, b, t = model.hidden_size, model.ffn_size, model.seq_length, micro_batch_size, tp
    act = settings.activation_bytes
    whole = s * b * h * (2 * RESIDUAL_BYTES + 2 * act)
    # Llama: attention keeps the rotated q, k and v repeated to every query head (full width even
    # under grouped-query attention: the runtime repeats them before SDPA) and its output; SwiGLU
    # keeps the gate, the up projection, silu(gate) and their product
    mlp = 4 * f if model.arch == "llama" else 2 * f
    width = model.q_size if model.arch == "llama" else h  # q, (repeated) k and v, the attention output
    split = s * b * act * (4 * width + mlp) / t
    if model.arch == "llama":  # RMSNorm (not fused) also keeps its normalized input before the weight, fp32
        whole += s * b * h * 2 * RESIDUAL_BYTES
    weight_copies = 2 * block_params(model) / t if settings.precision != "fp32" else 0.0
    return whole + split + weight_copies


def selective_activation_bytes(model: ModelSpec, settings: TrainingSettings, tp: int, micro_batch_size: int) -> float:
    """Bytes one block keeps per micro-batch under selective recompute (``hetrain.runtime.model.SELECTIVE_SAVE``).

    The block input (fp32 residual) and the outputs of what is costly to recompute: q, k, v and
    the attention output (split ``tp`` ways), the two projections back to ``h`` (whole; with
    ``tp > 1`` both the partial product and its all-reduced copy), the MLP's first product
    (split), and attention's log-sum-exp (fp32, one per head and position).
    """
    h, f, s, b, t = model.hidden_size, model.ffn_size, model.seq_length, micro_batch_size, tp
    act = settings.activation_bytes
    if model.arch == "llama":  # q, k, v (k and v kv-wide), the attention output, SwiGLU's gate and up products
        first = 2 * model.q_size + 2 * model.kv_size + 2 * f
    else:
        first = 4 * h + f
    products = s * b * act * (first / t + 2 * h * (2 if t > 1 else 1))
    return s * b * h * RESIDUAL_BYTES + products + s * b * (model.num_heads // t) * 4


def selective_recompute_bytes(model: ModelSpec, settings: TrainingSettings, tp: int, micro_batch_size: int) -> float:
    """Memory traffic of what selective recompute redoes in backward: it is elementwise, so bandwidth-bound.

    Each dropped tensor is read and written once more (the norms, GELU, the residual adds and,
    under autocast, the 16-bit weight copies): twice the bytes full recompute would keep beyond
    selective. The profiler measures it on the device; this is the estimate without one.
    """
    dropped = block_activation_bytes(model, settings, tp, micro_batch_size) \
        - selective_activation_bytes(model, settings, tp, micro_batch_size)
    return 2 * max(dropped, 0.0)

