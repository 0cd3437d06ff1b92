"""The trainer's state and its rules (layer 0: pure, no ray, no torch): one object for both modes.

A trainer -- the async Trainer actor, the sync worker, or the pipeline simulator's model of one -- keeps its step,
its param version and what it trained here, and asks this object when to push weights, when to save and which
trainer step a version belongs to.  Each rule is written once:
  * push: every `trigger_parameter_sync_step` steps and at the last step (sync mode: trigger 1, every step);
  * save: every `trainer.save_freq` param versions and at the last step, as verl (never when save_freq <= 0);
  * a version's step: version v was pushed by step v x trigger, or by the last step (the final push, however many
    steps its window had);
  * resume: the trainer's part of a checkpoint is `trainer_state.json` (`to_json` / `from_json`): step, version
    and the trained sample ids, so a resumed run trains every sample exactly once.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Optional


@dataclasses.dataclass
class TrainerState:
    total_steps: int              # the run's last step (run/prepare.py computes it before the actors start)
    trigger: int = 1              # trainer steps per param version (async_training.trigger_parameter_sync_step)
    save_freq: int = -1           # trainer.save_freq: param versions per checkpoint (<= 0: only on a stop)
    step: int = 0
    version: int = 0
    trained_sample_ids: list[str] = dataclasses.field(default_factory=list)
    response_lengths: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @classmethod
    def of(cls, cfg, total_steps: int) -> "TrainerState":
        """The state of a run configured by `cfg` (sync mode pushes every step)."""
        trigger = 1 if cfg.mode == "sync" else cfg.async_training.trigger_parameter_sync_step
        return cls(total_steps=total_steps, trigger=trigger, save_freq=cfg.trainer.save_freq)

    # ------------------------------------------------------------------ the rules
    def done(self) -> bool:
        return self.step >= self.total_steps

    def push_due(self) -> bool:
        """After a step: does it end a param version?"""
        return self.step % self.trigger == 0 or self.step == self.total_steps

    def save_due(self) -> bool:
        """After a push: every save_freq versions and at the last step, as verl."""
        return self.save_freq > 0 and (self.version % self.save_freq == 0 or self.step == self.total_steps)

    def step_of(self, version: int) -> int:
        """The trainer step that pushed `version`."""
        step = version * self.trigger
        return min(step, self.total_steps) if self.total_steps else step

    # ------------------------------------------------------------------ changes
    def record(self, sample_ids: Iterable[str], response_lengths: Iterable[int]) -> None:
        """A step trained these samples (in this order)."""
        self.trained_sample_ids.extend(sample_ids)
        self.response_lengths.update(response_lengths)
        self.step += 1

    def bump_version(self) -> int:
        self.version += 1
        return self.version

    # ------------------------------------------------------------------ checkpoint and result
    def to_json(self, model_path: str, mode: str) -> dict:
        return {"step": self.step, "version": self.version, "trained_sample_ids": list(self.trained_sample_ids),
                "model_path": model_path, "mode": mode}

    def load_json(self, saved: dict) -> None:
        """Continue from a checkpoint's trainer_state.json."""
        self.step, self.version = int(saved["step"]), int(saved["version"])
        self.trained_sample_ids = list(saved["trained_sample_ids"])

    def result(self, checkpoint: Optional[str], stopped: bool) -> dict:
        """What a trainer's run() returns to the driver."""
        return {"steps": self.step, "version": self.version, "trained_sample_ids": self.trained_sample_ids,
                "response_lengths": dict(self.response_lengths), "checkpoint": checkpoint, "stopped": stopped}


class RunTooShort(RuntimeError):
    """Training ended before the steps the run was asked for: the data ran out."""


def check_run_length(step: int, total_steps: int, cfg, filtered: Optional[int] = None) -> Optional[str]:
    """The trainer's data ran out after `step` of `total_steps` steps: RunTooShort naming why, unless the steps were
    derived from the data (trainer.steps_from_data) under dynamic sampling, where the run ends with its data as
    verl's DAPO does (at least one step trained): then the warning to log.  `filtered`: groups dynamic sampling
    dropped, when known.  None: the run is complete."""
    if step >= total_steps:
        return None
    fg = cfg.algorithm.filter_groups
    dropped = f"{filtered} groups" if filtered is not None else "groups"
    why = (f"dynamic sampling (algorithm.filter_groups, metric={fg.metric}) dropped {dropped} whose responses all "
           f"agree, and the prompts of trainer.total_epochs={cfg.trainer.total_epochs} epochs "
           f"(rollout.total_rollout_steps={cfg.rollout.total_rollout_steps}) were used up before enough were kept"
           if fg.enable else
           f"trainer.total_epochs={cfg.trainer.total_epochs} epochs of the data (rollout.total_rollout_steps="
           f"{cfg.rollout.total_rollout_steps} prompts) fill only that many steps")
    if fg.enable and getattr(cfg.trainer, "steps_from_data", False) and step > 0:
        return f"training ends with its data after {step} of at most {total_steps} steps: {why}"
    raise RunTooShort(f"training ended after {step} of the {total_steps} steps asked for "
                      f"(trainer.total_training_steps): {why}.  Raise trainer.total_epochs, lower "
                      "trainer.total_training_steps" + (", or change algorithm.filter_groups.metric (or the data: "
                                                        "too easy or too hard for the policy)" if fg.enable else ""))
