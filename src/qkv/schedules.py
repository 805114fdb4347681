"""Learning-rate schedules: the factor the optimizer's learning rate is multiplied by at each step.

What is here: :func:`inverse_sqrt` (the warmup schedule of Vaswani et al., 2017, eq. 3),
:func:`warmup_cosine` (Loshchilov & Hutter, 2017), :data:`SCHEDULES` (their names in a recipe's
``train.schedule``) and :func:`lr_factor` (a named schedule as a function of the step).
What is not here: the optimizer that applies them (:class:`~qkv.training.Trainer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable


def inverse_sqrt(step: int, *, warmup: int) -> float:
    """Learning-rate factor: linear warmup to 1 at ``warmup``, then ∝ 1/√step (eq. 3)."""
    step = max(step, 1)
    return min(step / warmup, math.sqrt(warmup / step)) if warmup > 0 else 1.0 / math.sqrt(step)


def warmup_cosine(step: int, *, warmup: int, total: int, floor: float = 0.0) -> float:
    """Learning-rate factor: linear warmup to 1, then a cosine decay to ``floor`` at ``total``
    (Loshchilov & Hutter, 2017). Ending low lets short runs settle into a minimum."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


SCHEDULES = ("inverse_sqrt", "cosine")


def lr_factor(schedule: str, *, warmup: int, total: int, floor: float) -> Callable[[int], float]:
    """The learning-rate multiplier of optimizer step ``s`` (0-based) for a named schedule."""
    if schedule == "inverse_sqrt":
        return lambda s: inverse_sqrt(s + 1, warmup=warmup)
    if schedule == "cosine":
        return lambda s: warmup_cosine(s, warmup=warmup, total=total, floor=floor)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
