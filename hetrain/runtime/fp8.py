"""fp8 matrix multiplies for a stage's blocks, through torchao's float8 training.

Why: Hopper and Ada GPUs (H100/H200, L40S, RTX 4090) run fp8 tensor-core matmuls at twice their
bf16 rate; torchtitan measures 1.28x the compiled bf16 throughput on Llama 3.1 8B with torchao's
``Float8Linear`` (tensorwise dynamic scaling). The weights, gradients and optimizer state stay
fp32 as under bf16 autocast (``hetrain.runtime.precision``); each linear layer of the blocks
casts its input, weight and output gradient to fp8 with a scale per tensor, and everything else
(attention's softmax, norms, the embedding and the vocabulary head, which torchtitan also keeps
out) runs in bf16 as before. On a CPU, torchao's emulation computes the same casts and scales
with an fp32 matmul: the numerics are testable without a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from hetrain.errors import HetrainError
from hetrain.spec.catalog import FP8_DIM_MULTIPLE, FP8_MAX_TP

FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have fp8 tensor cores; Ampere and older do not


def _divisible(module: nn.Module, _fqn: str) -> bool:
    return (isinstance(module, nn.Linear) and module.in_features % FP8_DIM_MULTIPLE == 0
            and module.out_features % FP8_DIM_MULTIPLE == 0)


def apply_fp8(stage: nn.Module, precision: str, device: torch.device, *, tp: int, asked_by: str = "--fp8") -> int:
    """Swap the linear layers of ``stage``'s blocks for torchao's ``Float8Linear``; returns how many.

    One-line errors naming what asked for fp8 (``asked_by``: the run-wide ``--fp8``, or the plan's stage):
    torchao missing, a GPU without fp8, fp8 asked of a stage not in bf16, or under tensor parallelism
    (torchao's float8 TP needs its own parallel styles, not wired here yet; the planner puts fp8 only on
    stages without TP, ``FP8_MAX_TP``).
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise HetrainError(f"{asked_by}: needs torchao (pip install 'hetrain[fp8]')") from None
    if precision != "bf16":
        raise HetrainError(f"{asked_by}: expected the stage in bf16 around its fp8 matmuls, got precision {precision}")
    if tp > FP8_MAX_TP:
        raise HetrainError(f"{asked_by}: tensor parallelism (tp {tp}) with fp8 is not supported yet; plan with tp 1")
    emulate = device.type != "cuda"
    if not emulate:
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            name, sm = torch.cuda.get_device_name(device), f"sm_{capability[0]}{capability[1]}"
            raise HetrainError(f"{asked_by}: {name} ({sm}) has no fp8 tensor cores (Ada sm_89 or Hopper sm_90 "
                               f"and later)")
    config = Float8LinearConfig(emulate=emulate)
    swapped = 0
    for block in stage.layers.values():
        before = sum(isinstance(m, nn.Linear) for m in block.modules())
        convert_to_float8_training(block, config=config, module_filter_fn=_divisible)
        swapped += before - sum(type(m) is nn.Linear for m in block.modules())
    return swapped
