"""DAPO's dynamic sampling (verl's `algorithm.filter_groups`, recipe/dapo): drop the groups that teach nothing.

A GRPO group whose n responses all score the same has zero advantage everywhere, so it adds no gradient and
only dilutes the batch.  With `filter_groups.enable` such a group is dropped after scoring and more prompts are
generated in its place until the step has its groups.  The per-response value compared is `metric`:

  acc               the scorer's `acc` (DAPO's math scorer returns it; a scorer without one is refused at its first
                    group, where verl's DAPO manager would take a float score as acc)
  score             the scorer's `score` when it returns one, else the reward (verl: the score before DAPO's
                    overlong penalty; here, with reward_model.overlong_buffer on, after it)
  seq_reward        the response's reward (verl: the sum of its token-level scores)
  seq_final_reward  the reward after the in-reward KL penalty (verl: token-level rewards); here the penalty is
                    applied by the trainer after filtering, so it is the reward (config_checks refuses it
                    together with algorithm.use_kl_in_reward)

As verl: a group is kept when the population std of its values is > 0, or when it has a single response.

`GroupFilter` keeps the counts that make "every prompt trained exactly once or counted as filtered" checkable
(kept, filtered, their uids) and verl's bound: a step whose batch is not full after `max_num_gen_batches` train
batches' worth of prompts fails, naming the key (the data are too hard or too easy for the policy).  Its state
is part of a checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from fully_async.core.config import FILTER_METRICS


class TooManyGenBatchesError(RuntimeError):
    pass


def response_value(sample: Any, metric: str) -> float:
    """The value of `metric` for one scored response (a Sample: `reward`, `reward_extra`)."""
    if metric == "acc":
        if "acc" not in sample.reward_extra:
            raise ValueError(f"algorithm.filter_groups.metric=acc, but the reward function returned no 'acc' for "
                             f"sample {sample.sample_id} (keys: {sorted(sample.reward_extra)}); use seq_reward")
        return float(sample.reward_extra["acc"])
    if metric == "score":
        return float(sample.reward_extra.get("score", sample.reward))
    if metric in ("seq_reward", "seq_final_reward"):
        return float(sample.reward)
    raise ValueError(f"algorithm.filter_groups.metric={metric!r} is not one of {', '.join(FILTER_METRICS)}")


def keep_group(values: Sequence[float]) -> bool:
    """verl's rule: std > 0 (np.std, population), or a group of one response."""
    if len(values) == 1:
        return True
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) > 0


@dataclass
class GroupFilter:
    """Which scored groups to train, and the counts of a run.  `required`: groups per trainer step;
    `max_num_gen_batches`: prompts one step may draw, in units of `required` (<= 0: no bound)."""

    metric: str
    required: int
    max_num_gen_batches: int = 0
    kept: int = 0                     # groups kept since the start of the run
    filtered_uids: list[str] = field(default_factory=list)  # groups dropped since the start of the run
    window_consumed: int = 0          # groups (kept + filtered) decided for the step being filled
    window_kept: int = 0              # of which kept

    @classmethod
    def from_config(cls, cfg: Any, required: int) -> "GroupFilter | None":
        """The run's filter, or None when algorithm.filter_groups.enable is false."""
        fg = cfg.algorithm.filter_groups
        if not fg.enable:
            return None
        return cls(fg.metric, required, int(fg.max_num_gen_batches))

    @property
    def filtered(self) -> int:
        return len(self.filtered_uids)

    def split(self, groups: Sequence[Any]) -> tuple[list, list]:
        """(kept, filtered) of scored groups (SampleGroup: `uid`, `samples`), counted; raises when a step has drawn
        more than its bound of prompts without filling up."""
        kept, dropped = [], []
        for g in groups:
            keep = keep_group([response_value(s, self.metric) for s in g.samples])
            (kept if keep else dropped).append(g)
            self._count(g, keep)
        return kept, dropped

    def end_step(self) -> None:
        """A step was trained short of `required` groups (the data ran out): the next one starts afresh."""
        self.window_consumed = self.window_kept = 0

    def _count(self, group: Any, was_kept: bool) -> None:
        self.window_consumed += 1
        if was_kept:
            self.kept += 1
            self.window_kept += 1
        else:
            self.filtered_uids.append(group.uid)
        if self.window_kept >= self.required:   # the step is full: the next one starts
            self.window_consumed = self.window_kept = 0
            return
        self.check_bound()

    def check_bound(self) -> None:
        """verl's error when the step is still short after max_num_gen_batches batches of prompts."""
        cap = self.max_num_gen_batches * self.required
        if self.max_num_gen_batches > 0 and self.window_consumed >= cap:
            raise TooManyGenBatchesError(
                f"dynamic sampling: {self.window_consumed} prompts generated for one step (algorithm.filter_groups."
                f"max_num_gen_batches={self.max_num_gen_batches} x {self.required} groups) and only "
                f"{self.window_kept} of the {self.required} groups it needs have responses whose "
                f"{self.metric} differ; the data are too hard or too easy for the policy.  Raise max_num_gen_batches "
                f"(0: no bound) or change algorithm.filter_groups.metric")

    def state_dict(self) -> dict:
        return {"metric": self.metric, "kept": self.kept, "filtered_uids": list(self.filtered_uids),
                "window_consumed": self.window_consumed, "window_kept": self.window_kept}

    def load_state_dict(self, state: dict) -> None:
        self.kept = int(state["kept"])
        self.filtered_uids = list(state["filtered_uids"])
        self.window_consumed = int(state["window_consumed"])
        self.window_kept = int(state["window_kept"])
