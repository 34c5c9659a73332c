"""Learning-rate schedule: linear warmup, then cosine decay to a floor (torchtitan's shape).

The learning rate is a pure function of the step and four numbers, so the schedule's whole
state is those numbers: they travel in the checkpoint (``to_tensor``/``from_tensor``, one small
replicated tensor, no pickle), and a run resumed on another plan, after a recovery or by the
next scheduled run continues the schedule it started with, whatever options the resume got.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

DEFAULT_LR = 3e-4  # a safe peak for GPT models of 0.1-2B parameters with warmup (GPT-3 paper, table 2.1)
DEFAULT_MIN_LR_RATIO = 0.1  # decay to 10 % of the peak (Chinchilla, GPT-3)
DEFAULT_MAX_WARMUP_STEPS = 200  # torchtitan's default warmup
DEFAULT_WARMUP_FRACTION = 0.1  # ... or a tenth of a short run, so tests and demos still train


class LRSchedule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: PositiveFloat = DEFAULT_LR
    lr_min: NonNegativeFloat = DEFAULT_LR * DEFAULT_MIN_LR_RATIO
    warmup_steps: NonNegativeInt = 0
    decay_steps: PositiveInt = 1  # cosine from the end of warmup to lr_min over this many steps, then flat

    @model_validator(mode="after")
    def _floor_below_peak(self) -> LRSchedule:
        if self.lr_min > self.lr:
            raise ValueError(f"lr_min {self.lr_min:g} is above lr {self.lr:g}")
        return self

    @classmethod
    def for_run(cls, total_steps: int, lr: float = DEFAULT_LR, lr_min: float | None = None,
                warmup_steps: int | None = None, decay_steps: int | None = None) -> LRSchedule:
        """Defaults from the run's length: warmup min(200, 10 %), cosine over the remaining steps."""
        if warmup_steps is None:
            warmup_steps = min(DEFAULT_MAX_WARMUP_STEPS, int(total_steps * DEFAULT_WARMUP_FRACTION))
        if decay_steps is None:
            decay_steps = max(1, total_steps - warmup_steps)
        return cls(lr=lr, lr_min=lr * DEFAULT_MIN_LR_RATIO if lr_min is None else lr_min,
                   warmup_steps=warmup_steps, decay_steps=decay_steps)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        return self.lr_min + 0.5 * (self.lr - self.lr_min) * (1 + math.cos(math.pi * progress))

    def to_tensor(self):
        import torch  # here, so the CLI imports this module without torch

        return torch.tensor([self.lr, self.lr_min, self.warmup_steps, self.decay_steps], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t) -> LRSchedule:
        lr, lr_min, warmup, decay = t.tolist()
        return cls(lr=lr, lr_min=lr_min, warmup_steps=round(warmup), decay_steps=round(decay))
