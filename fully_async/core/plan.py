"""What a config implies, computed in one place (layer 0, pure): devices per role, prompt groups per trainer
step, and the run's totals.  Every module that needs one of these asks `RunPlan.of(cfg)` instead of multiplying
config keys itself."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional


@dataclass(frozen=True)
class RunPlan:
    mode: str
    trainer_devices: int            # trainer.nnodes x trainer.n_gpus_per_node (data-parallel ranks)
    rollout_devices: int            # async: rollout.nnodes x rollout.n_gpus_per_node; sync: 0 (trainers generate)
    groups_per_step: int            # prompt groups one trainer step consumes (sync: data.train_batch_size;
    #                                 async: ppo_mini_batch_size x require_batches)
    placement: str = "split"        # async: split | colocated | elastic (async_training.placement); sync: colocated
    total_prompts: Optional[int] = None   # prompts the rollouter generates (known once the data is read)
    total_steps: Optional[int] = None     # trainer steps

    @property
    def total_devices(self) -> int:
        return self.trainer_devices + self.rollout_devices

    @classmethod
    def of(cls, cfg: Any) -> "RunPlan":
        """The plan of `cfg` (totals as the config states them: prepare fills them in before the actors start)."""
        sync = cfg.mode == "sync"
        groups = cfg.data.train_batch_size if sync else \
            cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.async_training.require_batches
        placement = "colocated" if sync else cfg.async_training.placement
        return cls(mode=cfg.mode, trainer_devices=cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node,
                   rollout_devices=0 if placement == "colocated" else cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node,
                   groups_per_step=groups, placement=placement, total_prompts=cfg.rollout.total_rollout_steps,
                   total_steps=cfg.trainer.total_training_steps)

    @property
    def engine_devices(self) -> int:
        """Devices that host an engine: the rollout devices, and the trainer's too when they are colocated or
        elastic."""
        return self.rollout_devices + (self.trainer_devices if self.placement in ("colocated", "elastic") else 0)

    def with_data(self, cfg: Any, num_train_prompts: int) -> "RunPlan":
        """Totals for `num_train_prompts` training prompts, as verl's fully-async rollouter counts them: the
        smaller of rollout.total_rollout_steps and the epochs over the data (trainer.total_epochs, and
        rollout.total_epochs when set); trainer.total_training_steps caps what is generated (no prompt is
        generated that no step uses), else the steps are what the prompts fill.  With dynamic sampling
        (algorithm.filter_groups.enable) the steps do not cap the prompts: a dropped group is replaced by another
        prompt, within the epochs (the rollouter stops drawing once the steps' groups are kept)."""
        epochs = cfg.trainer.total_epochs
        rollout_epochs = getattr(cfg.rollout, "total_epochs", None)
        if rollout_epochs is not None:
            epochs = min(epochs, rollout_epochs)
        total_prompts = epochs * num_train_prompts
        if cfg.rollout.total_rollout_steps:
            total_prompts = min(total_prompts, cfg.rollout.total_rollout_steps)
        if cfg.trainer.total_training_steps is not None:
            total_steps = cfg.trainer.total_training_steps
            if not cfg.rollout.total_rollout_steps and not cfg.algorithm.filter_groups.enable:
                total_prompts = min(total_prompts, total_steps * self.groups_per_step)
        else:
            total_steps = max(1, math.ceil(total_prompts / self.groups_per_step))
        return replace(self, total_prompts=total_prompts, total_steps=total_steps)
