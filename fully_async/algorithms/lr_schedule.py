"""The actor's learning-rate schedule (actor_rollout_ref.actor.optim.*), shared by every training backend.

verl's two schedules (verl.utils.torch_functional), as multipliers of `optim.lr`:

    warm-up   k < W:  k / W
    constant  k >= W: 1
    cosine    k >= W: max(0, x * (1 - min_lr_ratio) / 2 + (1 + min_lr_ratio) / 2),
                      x = cos(pi * num_cycles * 2 * progress), progress = (k - W) / max(1, total - W)

W is `lr_warmup_steps`, or `int(lr_warmup_steps_ratio * total)` when lr_warmup_steps < 0, and `total`
the run's optimizer steps.  Steps are optimizer steps (one per mini-batch), and k counts them from 1:
the optimizer step taken after `step` earlier ones uses the multiplier at k = step + 1.  verl's
LambdaLR evaluates its lambda at k = step instead, so its first warm-up step has lr 0; counting
from 1 keeps this package's warm-up (min(1, (step + 1) / W)) and makes the cosine's last step land
on min_lr_ratio.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from fully_async.core.config import LR_SCHEDULER_TYPES


def warmup_steps(optim: Any, total_optimizer_steps: int) -> int:
    """optim.lr_warmup_steps, or lr_warmup_steps_ratio of the run's optimizer steps when it is < 0."""
    if optim.lr_warmup_steps >= 0:
        return optim.lr_warmup_steps
    return int(optim.lr_warmup_steps_ratio * total_optimizer_steps)


def lr_multiplier(step: int, warmup: int, total: int, scheduler_type: str = "constant",
                  min_lr_ratio: float = 0.0, num_cycles: float = 0.5) -> float:
    """Multiplier of the base lr for the optimizer step taken after `step` (>= 0) earlier ones."""
    k = step + 1
    if k < warmup:
        return k / warmup
    if scheduler_type == "constant":
        return 1.0
    if scheduler_type == "cosine":
        coef, intercept = (1 - min_lr_ratio) * 0.5, (1 + min_lr_ratio) * 0.5
        progress = float(k - warmup) / float(max(1, total - warmup))
        return max(0.0, math.cos(math.pi * float(num_cycles) * 2.0 * progress) * coef + intercept)
    raise ValueError(f"lr_scheduler_type {scheduler_type!r} is not one of {list(LR_SCHEDULER_TYPES)}")


def lr_lambda(optim: Any, total_optimizer_steps: int) -> Callable[[int], float]:
    """step -> multiplier of optim.lr for the actor_rollout_ref.actor.optim section (a LambdaLR lambda).

    A plain function, so LambdaLR.state_dict() stores nothing of it (checkpoints keep their format)."""
    warmup = warmup_steps(optim, total_optimizer_steps)
    kind, min_ratio, cycles = optim.lr_scheduler_type, optim.min_lr_ratio, optim.num_cycles
    if kind not in LR_SCHEDULER_TYPES:
        raise ValueError(f"lr_scheduler_type {kind!r} is not one of {list(LR_SCHEDULER_TYPES)}")

    def multiplier(step: int) -> float:
        return lr_multiplier(step, warmup, total_optimizer_steps, kind, min_ratio, cycles)

    return multiplier
