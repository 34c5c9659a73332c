"""Learning-rate schedule: linear warmup, then cosine decay to a floor (torchtitan's shape).

The learning rate is a pure function of the step and four numbers, so the schedule's whole
state is those numbers and the run length it was made for: they travel in the checkpoint (named
float64 scalars in the train state, no pickle), and a run resumed on another plan or after a
recovery continues the schedule it started with, whatever options the resume got.

A run extended past the length its schedule was made for (``--steps`` raised, a scheduled run
that trains more) gets the schedule ``extended_to`` the new length: the cosine ends that many
steps later, so the new steps do not all train at the floor.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

DEFAULT_LR = 3e-4  # a safe peak for GPT models of 0.1-2B parameters with warmup (GPT-3 paper, table 2.1)
DEFAULT_MIN_LR_RATIO = 0.1  # decay to 10 % of the peak (Chinchilla, GPT-3)
DEFAULT_MAX_WARMUP_STEPS = 200  # torchtitan's default warmup
DEFAULT_WARMUP_FRACTION = 0.1  # ... or a tenth of a short run, so tests and demos still train
STATE_KEYS = ("lr", "lr_min", "warmup_steps", "decay_steps", "total_steps")  # its names in the train state


class LRSchedule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    lr: PositiveFloat = DEFAULT_LR
    lr_min: NonNegativeFloat = DEFAULT_LR * DEFAULT_MIN_LR_RATIO
    warmup_steps: NonNegativeInt = 0
    decay_steps: PositiveInt = 1  # cosine from the end of warmup to lr_min over this many steps, then flat
    total_steps: PositiveInt | None = None  # the run length it was made for (None: a checkpoint from before)

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
                   warmup_steps=warmup_steps, decay_steps=decay_steps, total_steps=total_steps)

    @property
    def planned_steps(self) -> int:
        """The run length this schedule was made for (before it was kept: where its decay ends)."""
        return self.total_steps or self.warmup_steps + self.decay_steps

    def extended_to(self, total_steps: int) -> LRSchedule:
        """This schedule for a run extended to ``total_steps``: its decay ends as many steps later.

        Unchanged when the run is not longer than planned (a resume, a run cut short) or when the
        decay already reaches ``total_steps`` (a decay set longer than the run, on purpose). A flat
        tail after the decay keeps its length.
        """
        decay_end = self.warmup_steps + self.decay_steps
        if total_steps <= self.planned_steps or decay_end >= total_steps:
            return self
        new_end = total_steps - max(0, self.planned_steps - decay_end)
        return self.model_copy(update={"decay_steps": new_end - self.warmup_steps, "total_steps": total_steps})

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        return self.lr_min + 0.5 * (self.lr - self.lr_min) * (1 + math.cos(math.pi * progress))

    def to_state(self) -> dict:
        """Named float64 scalars for the checkpoint's train state (a run length of 0: not known)."""
        import torch  # here, so the CLI imports this module without torch

        values = self.model_dump()
        return {k: torch.tensor(float(values[k] or 0), dtype=torch.float64) for k in STATE_KEYS}

    @classmethod
    def from_state(cls, state: dict) -> LRSchedule:
        values = {k: float(state[k]) for k in STATE_KEYS if k in state}
        return cls(lr=values["lr"], lr_min=values["lr_min"], warmup_steps=round(values["warmup_steps"]),
                   decay_steps=round(values["decay_steps"]), total_steps=round(values.get("total_steps", 0)) or None)


def describe_extension(extended: dict, step: int) -> str:
    """One line for a run extended past its planned length (the trainer's ``lr_schedule_extended`` record)."""
    return (f"the run was planned for {extended['from_steps']} steps and now trains to {extended['to_steps']}: its "
            f"learning-rate decay is stretched to end there (lr at step {step}: {extended['lr_before']:.3g} "
            f"-> {extended['lr_now']:.3g})")
