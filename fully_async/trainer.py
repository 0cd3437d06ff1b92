"""Trainer actor (layer 3): take a step's groups from the queue, update, push weights.

Per step: wait for `required_samples` groups (that wait is the trainer's idle time), build the
padded batch, compute the PPO old policy (the behaviour log-probs, or recomputed), reference
log-probs when a KL term needs them, GRPO advantages, then the update.  Every
`trigger_parameter_sync_step` steps the weights go to the rollouter and the param version
increments.  Metrics accumulate in a list the driver drains (`pop_metrics`).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from fully_async.algorithms import grpo_advantages, kl_penalty
from fully_async.batch import TrainBatch, build_batch
from fully_async.metrics import batch_metrics
from fully_async.staleness import required_samples
from fully_async.types import SampleGroup

logger = logging.getLogger(__name__)


def prepare_batch(backend: Any, cfg: Any, batch: TrainBatch, timing: dict) -> dict[str, float]:
    """Fill old/ref log-probs and advantages in place; returns metrics of this preparation."""
    at, actor, alg = cfg.async_training, cfg.actor_rollout_ref.actor, cfg.algorithm
    metrics: dict[str, float] = {}
    t = time.perf_counter()
    if at.use_rollout_log_probs and not at.decoupled_ppo:
        batch.old_log_probs = batch.rollout_log_probs
    else:
        batch.old_log_probs = backend.compute_log_probs(batch, "actor")
        diff = (batch.old_log_probs - batch.rollout_log_probs).abs() * batch.response_mask
        metrics["training/rollout_probs_diff_mean"] = float(diff.sum() / batch.response_mask.sum().clamp(min=1))
    timing["timing_s/old_log_prob"] = time.perf_counter() - t
    scores = batch.scores
    if actor.use_kl_loss or alg.use_kl_in_reward:
        t = time.perf_counter()
        batch.ref_log_probs = backend.compute_log_probs(batch, "ref")
        timing["timing_s/ref"] = time.perf_counter() - t
        if alg.use_kl_in_reward:
            kl = kl_penalty(batch.old_log_probs, batch.ref_log_probs, alg.kl_penalty) * batch.response_mask
            scores = scores - alg.kl_ctrl.kl_coef * kl.sum(-1)
            metrics["actor/reward_kl_penalty"] = float(kl.sum() / batch.response_mask.sum().clamp(min=1))
            metrics["actor/reward_kl_penalty_coeff"] = alg.kl_ctrl.kl_coef
    t = time.perf_counter()
    batch.advantages = grpo_advantages(scores, batch.group_ids, batch.response_mask, alg.norm_adv_by_std_in_grpo)
    timing["timing_s/adv"] = time.perf_counter() - t
    return metrics


class Trainer:
    def __init__(self, cfg: Any, queue: Any, rollouter: Any, total_steps: int, num_devices: int, pad_token_id: int):
        from fully_async.actor_setup import actor_init
        from fully_async.backends import build_backend
        from fully_async.weight_sync import ObjectStoreWeightSync

        self.cfg, self.device = actor_init(cfg, "trainer")
        cfg = self.cfg
        at = cfg.async_training
        self.queue = queue
        self.total_steps = total_steps
        self.num_devices = num_devices
        self.pad_token_id = pad_token_id
        self.required = required_samples(cfg.actor_rollout_ref.actor.ppo_mini_batch_size, at.require_batches)
        self.trigger = at.trigger_parameter_sync_step
        optimizer_steps = total_steps * at.require_batches * cfg.actor_rollout_ref.actor.ppo_epochs
        self.backend = build_backend(cfg, self.device, optimizer_steps)
        self.weight_sync = ObjectStoreWeightSync(rollouter)
        self.step = 0
        self.version = 0
        self.trained_sample_ids: list[str] = []
        self._metrics: list[tuple[int, dict]] = []
        self._lock = threading.Lock()
        self._last_rollouter: dict = {}

    def ready(self) -> bool:
        return True

    def pop_metrics(self) -> list[tuple[int, dict]]:
        with self._lock:
            out, self._metrics = self._metrics, []
        return out

    def sync_initial_weights(self) -> dict:
        """Send the version-0 weights (an engine started with load_format=dummy has random ones)."""
        return self.weight_sync.push(self.backend.named_parameters_for_sync(), self.version)

    def progress(self) -> dict:
        return {"step": self.step, "version": self.version, "total_steps": self.total_steps}

    def _emit(self, step: int, metrics: dict) -> None:
        with self._lock:
            self._metrics.append((step, metrics))

    def run(self) -> dict:
        last_end = time.perf_counter()
        while self.step < self.total_steps:
            wait_start = time.perf_counter()
            res = self.queue.get_batch.remote(self.required, 5.0)
            res = _ray_get(res)
            while not res["groups"] and not res["closed"]:
                self._emit_val(res["val"])
                res = _ray_get(self.queue.get_batch.remote(self.required, 5.0))
            wait_s = time.perf_counter() - wait_start
            self._emit_val(res["val"])
            if not res["groups"]:
                logger.info("queue closed and empty after %d steps: training ends", self.step)
                break
            metrics = self._train(res["groups"])
            self.step += 1
            if self.step % self.trigger == 0 or self.step == self.total_steps:
                metrics.update(self._sync_weights())
            now = time.perf_counter()
            step_s = now - last_end
            last_end = now
            metrics.update(self._pipeline_metrics(res["stats"], wait_s, step_s, metrics["perf/total_num_tokens"]))
            self._emit(self.step, metrics)
        if self.step % self.trigger != 0 and self.step != self.total_steps:
            self._emit(self.step, self._sync_weights())  # the last weights reach the engine for validation
        return {"steps": self.step, "version": self.version, "trained_sample_ids": self.trained_sample_ids}

    def _emit_val(self, val: list) -> None:
        for version, metrics in val:
            self._emit(version * self.trigger, dict(metrics))

    def _train(self, groups: list[SampleGroup]) -> dict:
        samples = [s for g in groups for s in g.samples]
        self.trained_sample_ids.extend(s.sample_id for s in samples)
        timing: dict[str, float] = {}
        batch = build_batch(samples, self.pad_token_id)
        metrics = prepare_batch(self.backend, self.cfg, batch, timing)
        t = time.perf_counter()
        mini = self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        metrics.update(self.backend.train_step(batch, num_mini_batches=math.ceil(len(groups) / mini)))
        timing["timing_s/update_actor"] = time.perf_counter() - t
        metrics.update(timing)
        metrics.update(batch_metrics(samples, self.version, self.cfg.data.max_response_length))
        metrics["fully_async/count/current_param_version"] = self.version
        return metrics

    def _sync_weights(self) -> dict:
        self.version += 1
        named = self.backend.named_parameters_for_sync()
        return self.weight_sync.push(named, self.version)

    def _pipeline_metrics(self, stats: dict, wait_s: float, step_s: float, tokens: float) -> dict:
        prev = self._last_rollouter
        m = {"timing_s/gen": wait_s, "timing_s/step": step_s, "perf/time_per_step": step_s,
             "perf/throughput": tokens / step_s / self.num_devices,
             "fully_async/trainer/idle_ratio": min(1.0, wait_s / step_s)}
        if stats:
            m["fully_async/count/total_generated_samples"] = stats["generated_samples"]
            m["fully_async/count/staleness_samples"] = stats["staleness_samples"]
            m["fully_async/rollouter/bound_pauses"] = stats["bound_pauses"]
            if prev:
                wall = stats["wall_s"] - prev["wall_s"]
                if wall > 0:
                    m["fully_async/rollouter/idle_ratio"] = min(1.0, (stats["idle_s"] - prev["idle_s"]) / wall)
            self._last_rollouter = stats
        return m


def _ray_get(ref: Any) -> Any:
    import ray
    return ray.get(ref)
