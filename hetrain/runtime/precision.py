"""Mixed precision for one pipeline stage, applied from outside like tensor parallelism.

``bf16`` and ``fp16`` follow torchtitan's choice when parameters are not sharded: parameters,
gradients and optimizer state stay fp32 (the "master" copy is the parameter itself), and the
forward runs under ``torch.autocast`` so matrix multiplies and attention run in 16 bits. What
this module adds is control over what crosses the wire, so it is in the dtype the cost model
charges (``TrainingSettings.activation_bytes``):

* Pipeline sends: a stage that is not the last casts its output hidden states to the compute
  dtype, so the activation sent forward and the gradient sent back are 16-bit. The next stage
  casts what it receives back to fp32 before its first residual add: the residual stream
  inside a stage stays fp32, as in a single-device autocast run, and is rounded to 16 bits
  once per stage boundary (the only numerical difference from one device; see the tests).
* TP collectives: the inputs of ``attn`` and ``mlp`` (the LayerNorm outputs, fp32 under
  autocast) are cast to the compute dtype before the column-parallel projections turn them
  into replicated DTensors. Autocast would round them to the same 16 bits inside the matmul
  anyway, so the values do not change; what changes is that the backward all-reduce of their
  gradient runs in 16 bits instead of fp32 (the forward all-reduces after ``wo`` and ``w2``
  already do, their outputs being autocast results).

The autocast weight cache is off: each weight is used once per micro-batch, so the cache
would only keep a 16-bit copy of every weight of the stage alive until the forward ends.

``fp16`` adds dynamic loss scaling (``LossScaler``): the loss is multiplied by the scale before
backward, gradients are unscaled with the clipping coefficient, and a step whose gradient norm
is not finite (on any pipeline: gradients are summed across pipelines before the norm) is
skipped by every rank together and halves the scale.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hetrain.config import Precision

COMPUTE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GRAD_REDUCE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_mixed_precision(stage: nn.Module, precision: Precision, device_type: str, *, is_last: bool) -> None:
    """Run ``stage`` (a ``hetrain.runtime.model.GPT``, possibly tensor-parallel) under autocast at ``precision``."""
    if precision == "fp32":
        return
    dtype = COMPUTE_DTYPE[precision]
    state: dict = {}

    def enter(_module: nn.Module, args: tuple) -> tuple:
        ctx = torch.autocast(device_type=device_type, dtype=dtype, cache_enabled=False)
        ctx.__enter__()
        state["ctx"] = ctx
        x = args[0]
        if x.is_floating_point() and x.dtype != torch.float32:  # received hidden states: fp32 residual stream
            return (x.float(), *args[1:])
        return args

    def leave(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        ctx = state.pop("ctx", None)
        if ctx is not None:
            ctx.__exit__(None, None, None)
        return out if is_last else out.to(dtype)

    def to_compute_dtype(_module: nn.Module, args: tuple) -> tuple:
        return (args[0].to(dtype), *args[1:])

    stage.register_forward_pre_hook(enter)
    stage.register_forward_hook(leave)
    for block in stage.layers.values():
        # prepend: run before the TP input hooks of the projections inside
        block.attn.register_forward_pre_hook(to_compute_dtype, prepend=True)
        block.mlp.register_forward_pre_hook(to_compute_dtype, prepend=True)
    if stage.head is not None:  # the vocabulary-split head's backward all-reduce, in the compute dtype too
        stage.head.register_forward_pre_hook(to_compute_dtype, prepend=True)


class LossScaler:
    """Dynamic loss scaling for fp16, the same rule on every rank (``torch.amp.GradScaler``'s defaults).

    Every rank sees the same global gradient norm (one all-reduce per step), so every rank takes
    the same decision and the scales never diverge. ``scale`` is 1 and nothing is ever skipped
    unless ``enabled``.
    """

    INIT_SCALE = 2.0**16  # GradScaler's default: large enough for tiny gradients, halves down quickly
    GROWTH_INTERVAL = 2000  # good steps before trying a scale twice as large (GradScaler's default)

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.scale = self.INIT_SCALE if enabled else 1.0
        self.good_steps = 0

    def update(self, grad_norm: float) -> bool:
        """After the global norm of the scaled gradients is known: whether to apply this step."""
        if not self.enabled:
            return True
        if not math.isfinite(grad_norm):
            self.scale /= 2
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps >= self.GROWTH_INTERVAL:
            self.scale *= 2
            self.good_steps = 0
        return True
