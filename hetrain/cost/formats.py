"""What a stage's number format costs: the rate its blocks compute at and what fp8 changes in their memory.

A stage's format is its GPU type's under the plan's precision and format policy (``GPUType.format_for``:
bf16, fp16 on a type without bf16 tensor cores, fp32; fp8 under the ``fastest`` policy). bf16, fp16 and
fp32 run the whole block at the type's rate for that format (``GPUType.achievable_flops``), as before.

fp8 is torchao's float8 training as ``hetrain.runtime.fp8`` runs it: only the blocks' linear layers (those
whose both dimensions ``torch._scaled_mm`` takes: ``FP8_DIM_MULTIPLE``) cast their input, weight and output
gradient to fp8, one scale per tensor; attention's core, the norms, the embedding and the head stay in bf16.
So a block's time in fp8 is its linear layers' FLOPs at the fp8 rate plus the rest at bf16's, and the fp8
rate is not the data sheet's twice bf16: an fp8 matmul pays for its casts (an amax pass and a cast of each
operand, memory-bound) beside the tensor-core work, which ``FP8_LINEAR_EFFICIENCY`` charges.

Memory (what torchao keeps, read from ``torchao.float8.float8_linear.matmul_with_hp_or_float8_args``): the
weights stay the fp32 parameters (their own master copy, as under bf16 autocast) and the gradients fp32.
For backward a ``Float8Linear`` saves its bf16 input, as autocast's linear does, and the fp32 parameter
itself where autocast saves a fresh bf16 copy of the weight per micro-batch: an fp8 stage keeps
2 bytes x its linear parameters less per micro-batch in flight (no recompute). Tensorwise dynamic scaling
keeps no state between steps (no amax history); its fp8 copies and fp32 scales live only around each
matmul: the largest linear's backward holds its fp8 input, weight and two casts of its output gradient
(``fp8_cast_bytes``), a transient beside backward's others. tests/unit/test_number_formats.py checks the
saving against the tensors autograd saves.
"""

from __future__ import annotations

from hetrain.spec.arithmetic import block_forward_flops
from hetrain.spec.catalog import FP8_DIM_MULTIPLE, GPUType
from hetrain.spec.specs import ModelSpec

# The share of the bf16 efficiency an fp8 linear layer reaches end to end, fitted to torchtitan's measurement
# (benchmarks/llama3_h100_202412_torchtitan.md, table 1: Llama 3.1 8B on 8 H100, FSDP, torch.compile, local batch 2,
# sequence 8192: bf16 6,667 tokens/s per GPU, Float8 tensorwise 8,532, 1.28x): with the blocks' linear FLOPs at the
# fp8 peak x efficiency x this and the rest at bf16's, the cost model prices that model's step 1.28x faster in fp8
# (tests/unit/test_number_formats.py); at the full fp8 peak it would say 1.57x. The casts (amax, scale, cast of
# each operand, memory-bound) are what the fp8 matmul pays beyond the tensor cores' work.
FP8_LINEAR_EFFICIENCY = 0.72
FP8_BYTES = 1  # e4m3 (weights, activations) and e5m2 (gradients) alike
FP8_SCALE_BYTES = 4  # one fp32 scale per cast tensor (tensorwise scaling)
FP8_CASTS_PER_LINEAR = 6  # forward: input and weight; backward: the output gradient twice, the weight and the input
BF16_BYTES = 2


def block_linears(model: ModelSpec) -> list[tuple[int, int]]:
    """(in, out) features of each linear layer of a block, as ``hetrain.runtime.model`` builds them."""
    h, f = model.hidden_size, model.ffn_size
    if model.arch == "llama":
        q, kv = model.q_size, model.kv_size
        return [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    return [(h, h)] * 4 + [(h, f), (f, h)]


def fp8_linears(model: ModelSpec) -> list[tuple[int, int]]:
    """The linear layers fp8 runs: both dimensions divisible by ``FP8_DIM_MULTIPLE`` (``hetrain.runtime.fp8``)."""
    return [(i, o) for i, o in block_linears(model) if i % FP8_DIM_MULTIPLE == 0 and o % FP8_DIM_MULTIPLE == 0]


def block_forward_s(model: ModelSpec, g: GPUType, precision: str, fmt: str, tp: int, micro_batch_size: int) -> float:
    """Seconds of one block's forward for one micro-batch on one of ``tp`` ranks, in the stage's format ``fmt``
    (backward is twice it): all of it at the type's rate for ``precision`` but in fp8, whose linear layers run at
    the fp8 rate (``FP8_LINEAR_EFFICIENCY``) and the rest at bf16's."""
    total = block_forward_flops(model, micro_batch_size)
    if fmt != "fp8" or g.fp8_tflops is None:
        return total / (tp * g.achievable_flops(precision))
    s, b = model.seq_length, micro_batch_size
    linear = sum(2 * s * b * i * o for i, o in fp8_linears(model))
    fp8_rate = g.achievable_flops("fp8") * FP8_LINEAR_EFFICIENCY
    return linear / (tp * fp8_rate) + (total - linear) / (tp * g.achievable_flops("bf16"))


def fp8_weight_copy_bytes(model: ModelSpec, tp: int) -> float:
    """Bytes per micro-batch in flight an fp8 block keeps less than under bf16 autocast, with no recompute: the
    16-bit weight copies autocast's linear layers save for backward (a ``Float8Linear`` saves the parameter)."""
    return BF16_BYTES * sum(i * o for i, o in fp8_linears(model)) / tp


def fp8_cast_bytes(model: ModelSpec, micro_batch_size: int) -> float:
    """Bytes an fp8 block's backward holds at once beyond bf16's, at most: its largest linear layer's fp8 input,
    weight and two casts of its output gradient, and their scales (freed after its matrix multiplies). Whole
    matrices: fp8 runs without tensor parallelism (``FP8_MAX_TP``)."""
    tokens = model.seq_length * micro_batch_size
    largest = max((FP8_BYTES * (tokens * i + i * o + 2 * tokens * o) for i, o in fp8_linears(model)), default=0.0)
    return largest + (FP8_CASTS_PER_LINEAR * FP8_SCALE_BYTES if largest else 0.0)


def block_flops_per_s(model: ModelSpec, g: GPUType, precision: str, fmt: str) -> float:
    """The FLOP/s one GPU's blocks sustain in ``fmt``: what a stage's useful work is weighed at."""
    if fmt != "fp8" or g.fp8_tflops is None:
        return g.achievable_flops(precision)
    return block_forward_flops(model, 1) / block_forward_s(model, g, precision, fmt, 1, 1)
