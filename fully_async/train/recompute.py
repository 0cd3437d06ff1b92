"""Whether the actor recomputes its activations in backward: actor_rollout_ref.model.enable_gradient_checkpointing as
set, or, unset, as the memory model decides for this device (planner/memory_model.checkpoints_activations)."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("fully_async")


def gradient_checkpointing(cfg: Any, device: Any) -> bool:
    """enable_gradient_checkpointing as set; unset (null): off where the memory model's trainer peak without it fits
    in its share of this device (beside the engine where the device is shared), on where the model's shape or the
    device's memory is unknown (verl's default).  Logs an unset key's decision once per trainer."""
    flag = cfg.actor_rollout_ref.model.enable_gradient_checkpointing
    if flag is not None:
        return bool(flag)
    from fully_async.planner.hardware import Shape
    from fully_async.planner.memory_model import checkpoints_activations, trainer_dp

    shape = Shape.of_model(cfg)
    capacity = device.total_memory()
    if shape is None or capacity is None:
        on, why = True, "the device's memory or the model's shape is unknown (verl's default)"
    else:
        on = checkpoints_activations(cfg, shape, trainer_dp(cfg), capacity)
        why = f"the memory model's trainer peak without it {'does not fit' if on else 'fits'} in its share of the device"
    logger.info("actor_rollout_ref.model.enable_gradient_checkpointing unset: %s (%s; set it to choose)",
                "on" if on else "off", why)
    return on
