"""The one training step both modes run (layer 2): the async Trainer and the sync loop call `train_step`.

Per step: build the padded batch of the groups' samples, compute the PPO "old" policy (the behaviour
log-probs, or recomputed), reference log-probs when a KL term needs them, GRPO advantages, then the
mini-batch updates, the bad-step check and the batch metrics.  One function, so the built-in sync-vs-async
comparison compares the same step, and one place decides how many mini-batches a step has.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from typing import Any, Optional, Sequence

from fully_async.algorithms import grpo_advantages, kl_penalty
from fully_async.batch import TrainBatch, build_batch
from fully_async.metrics import batch_metrics
from fully_async.types import Sample, SampleGroup

logger = logging.getLogger(__name__)


def num_mini_batches(num_groups: int, ppo_mini_batch_size: int) -> int:
    """Optimizer steps per ppo epoch: ppo_mini_batch_size groups each, a smaller last one counts too."""
    return max(1, math.ceil(num_groups / ppo_mini_batch_size))


def train_step(backend: Any, cfg: Any, groups: Sequence[SampleGroup], pad_token_id: int, step: int, version: int,
               timeline: Optional[Any] = None) -> tuple[dict[str, float], list[Sample]]:
    """Train on `groups` (step number `step`, generated for param `version`); returns (metrics, samples)."""
    span = timeline.span if timeline is not None else (lambda name: contextlib.nullcontext())
    samples = [s for g in groups for s in g.samples]
    timing: dict[str, float] = {}
    batch = build_batch(samples, pad_token_id)
    metrics = prepare_batch(backend, cfg, batch, timing, timeline)
    t = time.perf_counter()
    with span("update_actor"):
        metrics.update(backend.train_step(batch, num_mini_batches=num_mini_batches(
            len(groups), cfg.actor_rollout_ref.actor.ppo_mini_batch_size)))
    timing["timing_s/update_actor"] = time.perf_counter() - t
    check_bad_steps(backend, cfg, step, samples)
    metrics.update(timing)
    metrics.update(batch_metrics(samples, version, cfg.data.max_response_length))
    metrics["fully_async/count/current_param_version"] = version
    return metrics, samples


def prepare_batch(backend: Any, cfg: Any, batch: TrainBatch, timing: dict,
                  timeline: Optional[Any] = None) -> dict[str, float]:
    """Fill old/ref log-probs and advantages in place; returns metrics of this preparation."""
    at, actor, alg = cfg.async_training, cfg.actor_rollout_ref.actor, cfg.algorithm
    span = timeline.span if timeline is not None else (lambda name: contextlib.nullcontext())
    metrics: dict[str, float] = {}
    t = time.perf_counter()
    if at.use_rollout_log_probs and not at.decoupled_ppo:
        batch.old_log_probs = batch.rollout_log_probs
    else:
        with span("old_log_prob"):
            batch.old_log_probs = backend.compute_log_probs(batch, "actor")
        diff = (batch.old_log_probs - batch.rollout_log_probs).abs() * batch.response_mask
        metrics["training/rollout_probs_diff_mean"] = float(diff.sum() / batch.response_mask.sum().clamp(min=1))
    timing["timing_s/old_log_prob"] = time.perf_counter() - t
    scores = batch.scores
    if actor.use_kl_loss or alg.use_kl_in_reward:
        t = time.perf_counter()
        with span("ref"):
            batch.ref_log_probs = backend.compute_log_probs(batch, "ref")
        timing["timing_s/ref"] = time.perf_counter() - t
        if alg.use_kl_in_reward:
            kl = kl_penalty(batch.old_log_probs, batch.ref_log_probs, alg.kl_penalty) * batch.response_mask
            scores = scores - alg.kl_ctrl.kl_coef * kl.sum(-1)
            metrics["actor/reward_kl_penalty"] = float(kl.sum() / batch.response_mask.sum().clamp(min=1))
            metrics["actor/reward_kl_penalty_coeff"] = alg.kl_ctrl.kl_coef
    t = time.perf_counter()
    with span("adv"):
        batch.advantages = grpo_advantages(scores, batch.group_ids, batch.response_mask, alg.norm_adv_by_std_in_grpo)
    timing["timing_s/adv"] = time.perf_counter() - t
    return metrics


class BadStepsError(RuntimeError):
    pass


def check_bad_steps(backend: Any, cfg: Any, step: int, samples: list) -> None:
    """Log the batch of a skipped update; fail after trainer.max_bad_steps in a row."""
    if backend.consecutive_bad_steps == 0:
        return
    folder = os.path.join(cfg.trainer.default_local_dir, "bad_batches")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step}.json")
    with open(path, "w") as fh:
        json.dump([{"sample_id": s.sample_id, "reward": s.reward, "response_len": len(s.response_ids),
                    "versions": [s.param_version_start, s.param_version_end]} for s in samples], fh)
    logger.warning("step %d: non-finite loss or gradient, update skipped; batch logged to %s", step, path)
    if backend.consecutive_bad_steps >= cfg.trainer.max_bad_steps:
        raise BadStepsError(f"{backend.consecutive_bad_steps} consecutive optimizer steps had a NaN/inf loss or "
                            f"gradient (trainer.max_bad_steps={cfg.trainer.max_bad_steps}); last batch: {path}")


